"""Variable-length meeting data for tests: real padding in every micro-batch, uneven answer lengths; and the same
meetings as multi-turn chats."""

import json
import random
import re
from pathlib import Path

from ddp_ft.training.data.synthetic import generate_synthetic_meetings, write_mixed_length_meetings

__all__ = ["chat_meetings", "write_chat_meetings", "write_mixed_length_meetings"]

SYSTEM = "You are a meeting assistant. Answer from the transcript only."


def chat_meetings(n: int = 48, seed: int = 2, words: tuple[int, int] = (10, 120)) -> list[dict]:
    """``n`` meetings as OpenAI-style ``messages``: a system prompt, a transcript to summarise, then a follow-up
    question on its decisions. Transcripts keep ``words`` words of their opening and their recap, so lengths vary
    from row to row and the decisions stay in the transcript."""
    rng = random.Random(seed)
    rows = []
    for meeting in generate_synthetic_meetings(n, seed=seed):
        decisions = re.search(r"So, to sum up\. (.+?)\. Okay", meeting["dialogue"]).group(1)
        opening = " ".join(meeting["dialogue"].split()[: rng.randint(*words)])
        transcript = f"{opening} ... So, to sum up. {decisions}. Okay."
        summary = " ".join(meeting["summary"].split()[: rng.randint(5, 50)])
        rows.append(
            {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Summarize this meeting.\n\n{transcript}"},
                    {"role": "assistant", "content": summary},
                    {"role": "user", "content": "What did we decide?"},
                    {"role": "assistant", "content": decisions.replace("; ", ". ") + "."},
                ]
            }
        )
    return rows


def write_chat_meetings(path: str | Path, n: int = 48, seed: int = 2) -> str:
    """``chat_meetings`` as a jsonl file; returns ``path``, for ``--source``."""
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in chat_meetings(n, seed)))
    return str(path)
