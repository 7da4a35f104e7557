"""Import a released draft of the MTPC paper (april-tools/mtpc) into our draft format.

    python scripts/import_paper_draft.py <folder with config.yaml and model@<step>.pt> --out <dir>
        [--step N] [--model tiny|evabyte|llama3_byte] [--model-path <path or hub id>]

The target comes from the config's ``lm.model.from_huggingface`` unless ``--model`` /
``--model-path`` name it. Then ``python eval.py draft=<dir>``. What is mapped and what is
refused: ``mtpc/paper_import.py``; commands for the released drafts: docs/EVALUATION.md,
"The paper's drafts".
"""

from mtpc.paper_import import main

if __name__ == "__main__":
    main()
