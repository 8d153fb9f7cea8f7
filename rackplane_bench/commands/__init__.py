"""The commands of `rackplane sim ...` and `rackplane bench ...`, one module each: the command's
options as a dataclass, the typer command that builds it, and the function that does the work.
rackplane_bench/cli.py mounts them; common.py holds what they share."""
