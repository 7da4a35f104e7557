"""The allowed values of every named setting, defined once (no imports: cheap and torch-free),
so a new choice is added in one place. The drafting vocabulary and its mapping onto the draft
step's rules is in :mod:`mtpc.decoding.settings` (docs/DECODING.md, "Drafting").
"""

from __future__ import annotations

MODEL_NAMES = ("tiny", "evabyte", "llama3_byte")  # model= targets (mtpc.backbones.load_backbone)
CODEC_NAMES = ("tiny", "evabyte", "llama3_byte")  # byte codecs (mtpc.backbones.codecs)
CIRCUIT_KINDS = ("ff", "cp", "hmm", "btree")  # circuit families (mtpc.circuits.structure)
EXTRA_POSITIONS = ("repeat_last", "random")  # positions past the pretrained MTP heads (mtpc.heads)
HEAD_INITS = ("pretrained", "stp", "random")  # head initialisations (mtpc.model)
DTYPE_NAMES = ("float32", "bfloat16", "float16")  # target dtypes (mtpc.backbones.base.DTYPES)
ATTENTION_IMPLS = ("auto", "torch", "triton")  # EvaByte attention paths (mtpc.backbones.compat)
LOSS_NAMES = ("nll", "kl")
# the linear modules LoRA adapts by default (lora.target_modules; mtpc.backbones.lora)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STAGES = ("heads", "lora")

METHODS = ("speculative", "autoregressive")
# torch.compile backends of compile= (True: inductor); docs/DECODING.md, "Compiled decoding"
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_METHODS = ("autoregressive", "speculative")  # what compile= decodes (chains and trees)
C_COMPILERS = ("cc", "gcc", "g++")  # what inductor may build with (after $CC)
POLICIES = ("condition", "recompute", "drop")
SAMPLING_POLICIES = ("condition", "recompute")  # exact for speculative sampling (drop is biased)
DRAFTS = ("path", "map", "chain", "tree")  # what a cycle drafts; docs/DECODING.md, "Drafting"
# what speculative sampling verifies the drafts against; docs/DECODING.md, "Drafting"
PROPOSALS = ("path", "first_marginal", "marginal")
