"""What a trained model writes (``ddp-ft generate``), from prompts formatted exactly as its training formatted them.

    ddp-ft generate runs/tiny --prompt "Summarize this meeting. ..."      # the run's final/ (or newest checkpoint)
    ddp-ft generate runs/tiny --source held_out.jsonl --out preds.jsonl   # rows in the run's format; answers scored
    ddp-ft generate models/tiny-merged --prompt "..."                     # a model ddp-ft merge wrote

A prompt is written with the run's tokenizer, chat template, format and instruction (its ``ddp_ft_data.json``). Each
prediction is printed, and with --out also written to a new file as a JSON line (prompt, prediction, reference).
Rows of --source that hold an answer are scored: ROUGE-L against it.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from ..training.data.prompts import prompt_of, user_prompt
from ..training.data.sources import load_prompt_rows
from ..training.model.merge import MergeSettings
from ..training.model.positions import check_generation
from ..training.model.precision import DTYPES
from ..training.predict import generate, load_trained, rouge_l, write_predictions
from . import quiet_upstream_notices

logger = logging.getLogger(__name__)


def build_parser(parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None) -> argparse.ArgumentParser:
    """The generation's flags; ``parents`` (built with ``add_help=False``) add a caller's."""
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, parents=list(parents)
    )
    p.add_argument("model", metavar="RUN_OR_ADAPTER", help="a run's --output-dir, an adapter folder, or a merged model")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a prompt, as the user turn (repeat for several)")
    given.add_argument("--source", metavar="FILE", help="a .jsonl/.json/.csv/.parquet file in the run's data format")
    p.add_argument("--out", metavar="FILE", help="a new JSON-lines file of predictions (default: printed only)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens written per prompt")
    p.add_argument("--limit", type=int, default=0, help="--source: the first N rows only (0: all)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help="the dtype the model computes in")
    p.add_argument("--base-model", default=None, metavar="PATH", help="the base, if it moved since training")
    p.add_argument("--device", default="auto", help="auto (the first GPU, else cpu), cpu, cuda:N")
    return p


def parse_args(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> argparse.Namespace:
    """The flags (a wrong value exits with the usage, naming the flag)."""
    parser = build_parser(parents, prog)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens {args.max_new_tokens}: must be >= 1")
    if args.limit < 0:
        parser.error(f"--limit {args.limit}: must be >= 0 (0: every row)")
    if args.limit and args.prompt:
        parser.error("--limit counts the rows of --source; with --prompt, give fewer prompts instead")
    return args


def main(
    argv: list[str] | None = None, parents: Sequence[argparse.ArgumentParser] = (), prog: str | None = None
) -> None:
    """Parse, load, generate, write.

    Raises:
        SystemExit: an --out that exists, no model or data file, prompts the run's format cannot take; naming it.
    """
    quiet_upstream_notices()
    args = parse_args(argv, parents, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        if args.out and Path(args.out).exists():
            raise FileExistsError(f"--out {args.out} exists; generate never replaces a file. Give a new one.")
        settings = MergeSettings(dtype=args.dtype, base_model=args.base_model, device=args.device)
        trained = load_trained(args.model, settings)
        rows = _rows(args, trained)
        prompts = [prompt_of(row, trained.tokenizer, trained.data) for row in rows]
        longest = max((len(prompt.input_ids) for prompt in prompts), default=0)
        given = "--prompt" if args.prompt else "--source"
        warning = check_generation(trained.model, longest, args.max_new_tokens, given)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise SystemExit(f"{prog or 'generate'}: {error}") from None
    if warning:
        logger.warning("%s", warning)
    predictions = generate(trained.model, trained.tokenizer, prompts, args.max_new_tokens)
    for prediction in predictions:
        print(prediction.prediction, flush=True)
    if args.out:
        write_predictions(args.out, predictions)
    score = rouge_l(predictions)
    scored = "" if score is None else f"; ROUGE-L {score:.4f} against the rows' answers"
    logger.info("%d predictions%s%s", len(predictions), f" written to {args.out}" if args.out else "", scored)


def _rows(args: argparse.Namespace, trained) -> list[dict]:
    """The prompts as standard rows of the run's shape."""
    if args.prompt:
        return [user_prompt(text, trained.shape) for text in args.prompt]
    rows = load_prompt_rows(trained.data, args.source)
    count = len(rows) if not args.limit else min(args.limit, len(rows))
    return [rows[i] for i in range(count)]


if __name__ == "__main__":
    main()
