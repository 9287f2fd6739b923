"""`python -m msa_jit ...` == the `msa-jit` command."""

from .cli import main

raise SystemExit(main())
