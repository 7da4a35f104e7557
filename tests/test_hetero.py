"""Heterogeneous-vocabulary speculative decoding: exactness, distributions, bad input.

Greedy runs are compared token for token with the target's own greedy decoding; sampling
runs with bigram stubs (exact next-token distributions in closed form) are compared with the
enumerated target distribution of the first three tokens (TV distance and chi-square, fixed
seeds).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from scipy import stats

from mtpc.decoding.hetero import (
    PathEnumerator,
    PsiBoundError,
    SLRSTable,
    generate_hetero,
    slrs_psi,
    to_target_tokens,
)
from mtpc.decoding.vocab import (
    HeteroVocabularyError,
    InexpressibleTextError,
    as_tokenizer,
    byte_to_unicode,
    prompt_overlap,
    utf8_complete,
    vocab_mapping,
)
from mtpc.evaluation.fixture_drafters import tiny_llama, trained_models
from tests.hetero_fixtures import BigramLM, char_tokenizer, whitespace_tokenizer

PROMPTS = [
    "user: What is 12 plus 7?\nassistant:",
    "user: Reverse the word Hello.\nassistant: ",
    "user: ＨＥＬＬＯ ﬁne Straße, café?\nassistant: Ok",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matrices: one thread is fastest on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    return trained_models()


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


# --- vocabulary mapping ------------------------------------------------------------------------


def test_token_bytes_are_byte_aware(models):
    bpe = as_tokenizer(models["bpe"])
    codec = as_tokenizer(models["codec"])
    space = models["bpe"].convert_tokens_to_ids(byte_to_unicode()[ord(" ")])  # "Ġ"
    assert bpe.token_bytes[space] == b" "
    assert codec.token_bytes[ord(" ") + 64] == b" "
    mapping = vocab_mapping(models["codec"], models["bpe"])
    assert mapping.drafter_to_target[space] == ord(" ") + 64
    assert vocab_mapping(models["codec"], models["bpe"]) is mapping  # cached per pair
    # a surface string "Ġ" in a non-byte-level vocabulary is U+0120, not the space byte
    plain = as_tokenizer(char_tokenizer(["Ġ", " "]))
    assert plain.token_bytes[1] == "Ġ".encode() and plain.token_bytes[2] == b" "
    m2 = vocab_mapping(plain, models["bpe"])
    assert m2.drafter_to_target[space] == 2
    st = mapping.stats()
    assert st["vocab_intersection"] == 256 and st["vocab_intersection_over_target"] == 0.8
    ov = prompt_overlap(models["codec"], models["bpe"], PROMPTS)
    assert 0.0 < ov["prompt_intersection_over_target"] <= 1.0
    assert ov["prompt_tokens_target"] == len(set(b"".join(p.encode() for p in PROMPTS)))


def test_utf8_complete():
    e = "é".encode()
    assert utf8_complete(b"ab" + e[:1]) == 2
    assert utf8_complete(b"ab" + e) == 4
    assert utf8_complete("€".encode()[:2]) == 0
    assert utf8_complete(b"") == 0


def test_look_behind_alignment(models):
    bpe = as_tokenizer(models["bpe"])
    ctx = bpe.encode_bytes(b"user: hello")
    cands = to_target_tokens(bpe, ctx, b" world", look_behind=4)
    assert bpe.decode_bytes(cands) == b" world"
    lower = as_tokenizer(models["lower"])
    # non-injective: re-encoding the look-behind lowercases it; alignment falls back
    ctx = lower.encode_bytes(b"abc") + bpe.encode_bytes(b"")
    cands = to_target_tokens(lower, ctx, b" def", look_behind=4)
    assert lower.decode_bytes(cands) == b" def"


# --- greedy exactness ------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["slem", "tli", "union", "slrs"])
@pytest.mark.parametrize("drafter", ["bpe", "lower"])
def test_greedy_equals_target_byte_target(models, algorithm, drafter):
    """Byte-level target, BPE drafters (one normalising, non-injective)."""
    codec = models["codec"]
    for prompt in PROMPTS:
        ids = as_tokenizer(codec).prompt_ids(prompt)
        ref = greedy_reference(models["byte_lm"], ids, 32)
        res = generate_hetero(
            models["byte_lm"], codec, models[f"{drafter}_lm"], models[drafter], ids,
            algorithm=algorithm, lookahead=4, max_new_tokens=32, stop_ids=[],
        )  # fmt: skip
        assert res.tokens == ref, (algorithm, drafter, prompt)
        assert res.text == codec.decode(ref)
        assert res.target_passes == len(res.accepted)
        assert sum(res.accepted) < len(res.tokens) <= sum(res.accepted) + len(res.accepted)


def test_slem_accepts_and_is_non_injective(models):
    lower = as_tokenizer(models["lower"])
    text = "ＨＥＬＬＯ ﬁne".encode()
    assert lower.decode_bytes(lower.encode_bytes(text)) != text  # non-injective
    ids = as_tokenizer(models["codec"]).prompt_ids(PROMPTS[0])
    res = generate_hetero(
        models["byte_lm"], models["codec"], models["lower_lm"], models["lower"], ids,
        max_new_tokens=48, stop_ids=[],
    )  # fmt: skip
    assert sum(res.accepted) > 0  # drafts are really accepted


@pytest.mark.parametrize("algorithm", ["slem", "tli", "union", "slrs"])
def test_greedy_equals_target_bpe_target(models, algorithm):
    """The reverse pair: BPE target, byte-level drafter; and a normalising target."""
    for target, tok, drafter, d_tok in (
        ("bpe_lm", "bpe", "byte_lm", "codec"),
        ("lower_lm", "lower", "bpe_lm", "bpe"),
    ):
        ids = as_tokenizer(models[tok]).prompt_ids(PROMPTS[1].lower())
        ref = greedy_reference(models[target], ids, 16)
        res = generate_hetero(
            models[target], models[tok], models[drafter], models[d_tok], ids,
            algorithm=algorithm, lookahead=3, max_new_tokens=16, stop_ids=[],
        )  # fmt: skip
        assert res.tokens == ref, (algorithm, target, drafter)


def test_standard_same_vocabulary(models):
    codec = models["codec"]
    ids = as_tokenizer(codec).prompt_ids(PROMPTS[0])
    ref = greedy_reference(models["byte_lm"], ids, 32)
    res = generate_hetero(
        models["byte_lm"], codec, models["byte_small"], codec, ids,
        algorithm="standard", max_new_tokens=32, stop_ids=[],
    )  # fmt: skip
    assert res.tokens == ref and sum(res.accepted) > 0


# --- sampling: exact target distribution (enumerated) ------------------------------------------

STEPS = 3


def exact_distribution(target: BigramLM, prompt_last: int, stop: int) -> dict[tuple, float]:
    out: dict[tuple, float] = {}

    def walk(seq: tuple, last: int, prob: float) -> None:
        if len(seq) == STEPS or (seq and seq[-1] == stop):
            out[seq] = out.get(seq, 0.0) + prob
            return
        p = target.next_probs(last)
        for t in range(p.shape[0]):
            walk((*seq, t), t, prob * float(p[t]))

    walk((), prompt_last, 1.0)
    return out


def bigram(vocab: int, seed: int, scale: float = 1.5) -> BigramLM:
    g = torch.Generator().manual_seed(seed)
    return BigramLM(torch.randn(vocab, vocab, generator=g) * scale)


def empirical(runs: int, **kwargs) -> tuple[dict[tuple, int], float]:
    counts: dict[tuple, int] = {}
    accepted = 0
    for seed in range(runs):
        res = generate_hetero(seed=seed, greedy=False, max_new_tokens=STEPS, **kwargs)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += sum(res.accepted)
    return counts, accepted / runs


def assert_same_distribution(counts: dict[tuple, int], exact: dict[tuple, float]) -> None:
    """TV and chi-square on the joint of the first tokens and on the first token alone."""
    assert set(counts) <= {k for k, v in exact.items() if v > 0}
    _check(counts, exact)
    first: dict[tuple, int] = {}
    first_exact: dict[tuple, float] = {}
    for k, v in counts.items():
        first[k[:1]] = first.get(k[:1], 0) + v
    for k, p in exact.items():
        first_exact[k[:1]] = first_exact.get(k[:1], 0.0) + p
    _check(first, first_exact)


def _check(counts: dict[tuple, int], exact: dict[tuple, float]) -> None:
    n = sum(counts.values())
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - p) for k, p in exact.items())
    # chi-square over cells with expected count >= 5 (the rest pooled)
    obs, exp, rest_o, rest_e = [], [], 0.0, 0.0
    for k, p in exact.items():
        if p * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(p * n)
        else:
            rest_o += counts.get(k, 0)
            rest_e += p * n
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    p_value = stats.chi2.sf(chi2, len(obs) - 1)
    assert tv < 0.06 and p_value > 1e-3, (tv, p_value)


# Pair A: target over characters, drafter with extra merged tokens (ab, ba) outside T.
T_CHARS = char_tokenizer(["a", "b", "c"])
D_MERGED = char_tokenizer(["a", "b", "c"], [("a", "b"), ("b", "a")])
# Pair B: target with multi-character tokens (ab, bb), character drafter (SLRS psi sums).
T_MERGED = char_tokenizer(["a", "b"], [("a", "b"), ("b", "b")])
D_CHARS = char_tokenizer(["a", "b"])

RUNS = 1500


@pytest.mark.parametrize(
    ("algorithm", "pair"),
    [
        ("tli", "A"), ("union", "A"), ("slrs", "A"), ("slem", "A"),
        ("tli", "B"), ("slrs", "B"), ("slem", "B"), ("standard", "S"),
    ],
)  # fmt: skip
@pytest.mark.slow
def test_sampling_reproduces_target_distribution(algorithm, pair):
    if pair == "A":
        t_tok, d_tok, vt, vd = T_CHARS, D_MERGED, 4, 6
    elif pair == "B":
        t_tok, d_tok, vt, vd = T_MERGED, D_CHARS, 5, 3
    else:
        t_tok, d_tok, vt, vd = T_CHARS, T_CHARS, 4, 4
    target, drafter = bigram(vt, 1), bigram(vd, 2)
    # a drafter close to the target on shared tokens so that drafts are accepted
    shared = vocab_mapping(t_tok, d_tok)
    with torch.no_grad():
        for ti, di in zip(shared.target_ids.tolist(), shared.drafter_ids.tolist(), strict=True):
            drafter.table[di, shared.drafter_ids] = 0.7 * target.table[ti, shared.target_ids]
        drafter.table[:, 0] -= 2.0  # the drafter rarely ends the text (no proposal)
    counts, acc = empirical(
        RUNS, target=target, target_tokenizer=t_tok, drafter=drafter, drafter_tokenizer=d_tok,
        prompt=[1], algorithm=algorithm, lookahead=2,
    )  # fmt: skip
    assert acc > 0.1  # drafts are really accepted
    assert_same_distribution(counts, exact_distribution(target, 1, stop=0))


def test_slrs_psi_enumeration_closed_form():
    """psi(a) = Q(a) - Q(ab), psi(b) = Q(b) - Q(bb) for a character drafter."""
    table = SLRSTable.build(as_tokenizer(T_MERGED), 2)
    assert table.extensions[1] == [3] and table.extensions[2] == [4]
    q1 = torch.tensor([0.1, 0.5, 0.4], dtype=torch.float64)  # eos, a, b
    q2 = {(1,): torch.tensor([0.2, 0.3, 0.5]), (2,): torch.tensor([0.3, 0.6, 0.1])}
    enum = PathEnumerator(lambda path: q2.get(path, q1), as_tokenizer(D_CHARS).token_bytes, 10)
    q = dict(zip(table.ids.values(), enum.prefix_probs(list(table.ids)), strict=True))
    psi = table.psi(q, 5)
    expected = [0.0, 0.5 - 0.5 * 0.5, 0.4 - 0.4 * 0.1, 0.5 * 0.5, 0.4 * 0.1]
    assert torch.allclose(psi, torch.tensor(expected, dtype=torch.float64))
    assert math.isclose(float(psi.sum()), 0.9)  # 0.1 is the drafter's EOS: no proposal


def test_union_acceptance_below_tli():
    """Their Theorem 4.1 on a constructed case: the drafter puts mass on ab, ba (not in T)."""
    target, drafter = bigram(4, 5), bigram(6, 6)
    with torch.no_grad():
        drafter.table[:, 4:] += 2.0  # ab, ba likely
    p = target.next_probs(1)[1:]  # a, b, c (the prompt is "a")
    q = drafter.next_probs(1)
    q_shared = q[1:4]
    alpha_union = float(
        torch.minimum(p, q_shared).sum() + torch.minimum(target.next_probs(1)[0], q[0])
    )
    q_tli = q[:4] / q[:4].sum()
    alpha_tli = float(torch.minimum(target.next_probs(1), q_tli).sum())
    assert alpha_union < alpha_tli
    rates = {}
    for algorithm in ("union", "tli"):
        accepted = 0
        for seed in range(600):
            res = generate_hetero(
                target, T_CHARS, drafter, D_MERGED, [1], algorithm=algorithm, lookahead=1,
                greedy=False, seed=seed, max_new_tokens=1,
            )  # fmt: skip
            accepted += res.accepted[0]
        rates[algorithm] = accepted / 600
    assert rates["union"] < rates["tli"]
    assert abs(rates["union"] - alpha_union) < 0.06 and abs(rates["tli"] - alpha_tli) < 0.06


# --- SLRS with an MTPC circuit drafter ----------------------------------------------------------


@pytest.fixture(scope="module")
def circuit_drafter(models):
    from mtpc.model import MTPCModel

    torch.manual_seed(0)
    return MTPCModel.from_hf(
        tiny_llama(320, 7, 32, 1), kind="cp", window=4, rank=2, head_init="random"
    ).eval()


def test_slrs_circuit_psi_equals_enumerated_psi(models, circuit_drafter):
    from mtpc.decoding import hetero
    from mtpc.decoding.common import TargetRule

    bpe = as_tokenizer(models["bpe"])
    codec = as_tokenizer(models["codec"])
    table = SLRSTable.build(bpe, 4)
    rule = TargetRule(greedy=False, sample_dtype=torch.float64)
    sess = hetero._Session(
        models["bpe_lm"], bpe, circuit_drafter, codec, [5, 6], rule, torch.Generator()
    )
    d_ids, pending = sess.drafter_context()
    sess.circuit.condition(d_ids)
    enum = PathEnumerator(sess.circuit.dist, codec.token_bytes, 4096)
    by_circuit = slrs_psi(table, sess, enum, pending, len(bpe.token_bytes), "circuit")
    by_paths = slrs_psi(table, sess, enum, pending, len(bpe.token_bytes), "enumerate")
    assert torch.allclose(by_circuit, by_paths, atol=1e-6)
    assert 0.5 < float(by_circuit.sum()) <= 1.0 + 1e-6 and float(by_circuit.min()) >= 0.0
    # and the decoders agree draw for draw
    ids = bpe.prompt_ids(PROMPTS[0])
    for seed in range(3):
        runs = [
            generate_hetero(
                models["bpe_lm"],
                models["bpe"],
                circuit_drafter,
                models["codec"],
                ids,
                algorithm="slrs",
                greedy=False,
                seed=seed,
                max_new_tokens=6,
                psi=psi,
            )
            for psi in ("circuit", "enumerate")
        ]
        assert runs[0].tokens == runs[1].tokens and runs[0].accepted == runs[1].accepted


def test_slrs_circuit_greedy_equals_target(models, circuit_drafter):
    ids = as_tokenizer(models["bpe"]).prompt_ids(PROMPTS[0])
    ref = greedy_reference(models["bpe_lm"], ids, 12)
    res = generate_hetero(
        models["bpe_lm"], models["bpe"], circuit_drafter, models["codec"], ids,
        algorithm="slrs", max_new_tokens=12, stop_ids=[],
    )  # fmt: skip
    assert res.tokens == ref


# --- bad input ---------------------------------------------------------------------------------


def test_tli_empty_intersection_suggests_slem():
    t_tok = char_tokenizer(["a", "b"])
    d_tok = char_tokenizer(["x", "y"], eos="</s>")
    with pytest.raises(HeteroVocabularyError, match="slem"):
        generate_hetero(bigram(3, 0), t_tok, bigram(3, 1), d_tok, [1], algorithm="tli")


def test_drafter_that_cannot_express_the_text(models):
    ascii_only = whitespace_tokenizer(models["texts"][:50])
    drafter = tiny_llama(len(ascii_only), 0, 16, 1)
    with pytest.raises(InexpressibleTextError, match=r"drafter.*cannot express.*'€'"):
        generate_hetero(
            models["byte_lm"], models["codec"], drafter, ascii_only, "price: 5 € only",
            algorithm="slem", max_new_tokens=4,
        )  # fmt: skip


def test_psi_enumeration_bound_names_the_token(models):
    ids = as_tokenizer(models["bpe"]).prompt_ids(PROMPTS[0])
    with pytest.raises(PsiBoundError, match=r"target token b'.*max_psi_paths=3"):
        generate_hetero(
            models["bpe_lm"], models["bpe"], models["byte_lm"], models["codec"], ids,
            algorithm="slrs", greedy=False, lookahead=4, max_psi_paths=3, max_new_tokens=4,
        )  # fmt: skip


def test_bad_settings(models, circuit_drafter):
    args = (models["byte_lm"], models["codec"], models["bpe_lm"], models["bpe"])
    with pytest.raises(ValueError, match="algorithm='nope' is not allowed"):
        generate_hetero(*args, "hi", algorithm="nope")
    with pytest.raises(ValueError, match="lookahead=0 is not allowed"):
        generate_hetero(*args, "hi", lookahead=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_hetero(*args, [])
    with pytest.raises(HeteroVocabularyError, match="standard"):
        generate_hetero(*args, "hi", algorithm="standard")
    with pytest.raises(ValueError, match="slrs"):
        generate_hetero(models["bpe_lm"], models["bpe"], circuit_drafter, models["codec"], "hi")
    with pytest.raises(TypeError, match="tokenizer"):
        generate_hetero(models["byte_lm"], object(), models["bpe_lm"], models["bpe"], "hi")
    with pytest.raises(ValueError, match="temperature"):
        generate_hetero(*args, "hi", greedy=False, temperature=0.0)


def test_enumeration_count_matches_lemma():
    """Lemma 3.3: a complete vocabulary over {a, b} gives 2^(m-1) paths per length-m token."""
    symbols = ["a", "b"]
    words = ["".join(w) for n in (2, 3) for w in itertools.product(symbols, repeat=n)]
    drafter_tb = [None, b"a", b"b", *(w.encode() for w in words)]
    calls = []

    def dist(path):
        calls.append(path)
        return torch.full((len(drafter_tb),), 1.0 / len(drafter_tb), dtype=torch.float64)

    enum = PathEnumerator(dist, drafter_tb, 1000)
    enum.prefix_probs([b"aaa"])
    # internal nodes: (), a, aa, a|a -> spelled proper prefixes of "aaa" by token paths
    assert len(calls) == 4  # 2^(3-1) paths = {aaa}, {a, aa}, {aa, a}, {a, a, a}


def test_evaluate_hetero_reports_metrics_and_overlap(models):
    from mtpc.evaluation.hetero import evaluate_hetero

    out = evaluate_hetero(
        models["byte_lm"], models["codec"], models["bpe_lm"], models["bpe"], PROMPTS[:2],
        algorithm="slem", lookahead=4, max_new_tokens=16, warmup=0, stop_ids=[],
    )  # fmt: skip
    ar, sd = out["rows"]
    assert ar["mu_acc"] == 1.0 and sd["mu_acc"] >= 1.0 and sd["tokens"] == ar["tokens"] == 32
    assert sd["speedup_ar"] > 0 and out["overlap"]["vocab_intersection"] == 256
    assert 0 < out["overlap"]["prompt_intersection_over_target"] <= 1
