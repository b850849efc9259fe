"""Memory per GPU of Qwen3-4B in 4-bit QLoRA: peft's float32 upcast of the frozen weights vs keeping them (the body:
``ddp_ft.tools.memory_4bit``; ``--help`` for every flag).

    python scripts/memory_4bit.py --out docs/memory_4bit_cpu.json

A CPU proxy (2 layers at full width) against the arithmetic; exits 1 if they differ. About 35 s and 4.2 GB of RAM on
2 cores.
"""

from __future__ import annotations

from ddp_ft.tools.memory_4bit import main

if __name__ == "__main__":
    raise SystemExit(main())
