"""`python -m rackserve ...`: the `rackserve` command (serve/cli.py), as vLLM's `python -m vllm`.
This file owns nothing else."""
import sys

from rackserve.serve.cli import main

sys.exit(main())
