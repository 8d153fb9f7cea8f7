"""The scheduling edge: between the domains and the pure placement core.

- `world`: a region as the core sees it, read from the database (and kept per worker
  process, brought up to date from what changed); the core's own view of it is
  `app.placement.Snapshot`, a different thing with a different name;
- `cycle`: one cycle for a region under its advisory lock, and the dry run of one workload;
- `apply`: the plan applied in the cycle's transaction, and the allocation accounting (claim,
  release, stop) every writer of allocations shares;
- `lifecycle`: the workload state machine every writer of a workload's state goes through;
- `providers`: what turns an allocation into running work (simulated today, the node agent next);
- `tasks`: the placement cycle and tick as Celery tasks.
"""
