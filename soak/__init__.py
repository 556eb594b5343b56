"""Long runs that try to break a cluster on a local Ray instance: the trace soak with cancels,
deadlines and worker kills, the overload phase, and link faults between two Ray nodes."""
