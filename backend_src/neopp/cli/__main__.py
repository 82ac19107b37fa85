"""``python -m neopp.cli``: the same as the ``neopp`` console script."""

from neopp.cli.main import main

raise SystemExit(main())
