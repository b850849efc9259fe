"""``python -m ddp_ft.tools.forecast_check``: see :mod:`ddp_ft.tools.forecast_check`."""

from .cli import main

if __name__ == "__main__":
    main()
