"""`python -m appliance.cli`: the command line."""

from appliance.cli.main import main

raise SystemExit(main())
