"""The scheduling edge: between the domains and the pure placement core.

- `cycle`: a region's snapshot read from the database, one cycle of the core
  (`app.placement.queueing`) over it, and its plan applied in the same transaction;
- `lifecycle`: the workload state machine every writer of a workload's state goes through;
- `providers`: what turns an allocation into running work (simulated today, the node agent next);
- `tasks`: the placement cycle and tick as Celery tasks.
"""
