"""Node software stacks: what each node should run, pinned as one artifact, and its drift."""
