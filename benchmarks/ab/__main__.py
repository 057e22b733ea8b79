"""``python -m benchmarks.ab``: the A/B harness's command (see ``cli.py``)."""
from .cli import main

if __name__ == "__main__":
    main()
