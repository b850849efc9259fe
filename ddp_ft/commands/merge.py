"""A model to serve: merge a run's LoRA adapter into its base (``ddp-ft merge``).

    ddp-ft merge runs/tiny --out models/tiny-merged                  # the run's final/ (or newest checkpoint)
    ddp-ft merge runs/tiny/final --out models/tiny-merged --base original --dtype float16
    ddp-ft merge adapter/ --out merged/ --base-model Qwen/Qwen3-4B  # another base than adapter_config.json names

Writes a standalone model (``save_pretrained``), its tokenizer with the chat template it trained with, and the run's
``ddp_ft_data.json``, into a new or empty --out folder (``ddp_ft.training.model.merge``).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from ..training.model.merge import BASES, MergeSettings, merge_adapter
from ..training.model.precision import DTYPES
from . import quiet_upstream_notices


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """The merge's flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument(
        "source",
        metavar="RUN_OR_ADAPTER",
        help="a run's --output-dir (its final/, else its newest checkpoint's adapter) or an adapter folder",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder for the merged model")
    p.add_argument(
        "--base",
        choices=BASES,
        default="trained",
        help="trained: the base as training saw it, its NF4 weights dequantised (the original weights if the run's "
        "run_config.yaml says load_in_4bit: false); original: the published 16-bit weights, loaded unquantised. "
        "Default: trained",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="the merged model's dtype, and the dtype the base loads in before it is quantised; give the run's "
        "compute dtype to quantise exactly as it did. auto: bfloat16 (float16 on a GPU below compute capability "
        "8.0). Default: auto",
    )
    p.add_argument(
        "--base-model",
        default=None,
        metavar="PATH",
        help="folder or hub id of the base model, instead of base_model_name_or_path in the adapter's "
        "adapter_config.json (a model moved since training)",
    )
    p.add_argument(
        "--device", default="auto", help="where to load and merge: auto (the first GPU, else cpu), cpu, cuda:N"
    )
    return p


def parse_args(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> tuple[argparse.Namespace, MergeSettings]:
    """The flags, and the settings they make (a wrong value exits with the usage, naming the flag)."""
    parser = build_parser(parents, prog)
    args = parser.parse_args(argv)
    try:
        settings = MergeSettings(base=args.base, dtype=args.dtype, base_model=args.base_model, device=args.device)
    except ValueError as error:
        parser.error(str(error))
    return args, settings


def main(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> None:
    """Parse, merge, say where the model is.

    Raises:
        SystemExit: no adapter, a base model that cannot be found, an --out folder that is not empty; naming it.
    """
    quiet_upstream_notices()
    args, settings = parse_args(argv, parents, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        merge_adapter(args.source, args.out, settings)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise SystemExit(f"{prog or 'merge'}: {error}") from None


if __name__ == "__main__":
    main()
