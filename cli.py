"""Run `python cli.py ...` from a checkout, without installing."""

from lora_llama.cli import main

raise SystemExit(main())
