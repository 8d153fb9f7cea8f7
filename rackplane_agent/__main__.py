"""`python -m rackplane_agent ...`: the node agent's command line (see `rackplane_agent.cli`)."""

from rackplane_agent.cli import main

raise SystemExit(main())
