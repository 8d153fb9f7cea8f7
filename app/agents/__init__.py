"""Node agents: how one joins (a single-use token traded for a node credential), and, as the
agent grows, what it is assigned and what it reports."""
