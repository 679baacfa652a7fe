"""The IR every stage shares: the spec, the plan and its geometry, the program, the timeline; and the
small utilities below the passes (errors, units, memoisation, the forked worker)."""
