"""The planner: fill every `auto` of a spec's parallel plan (docs/planner.md).

    partition  bandwidth domains by Gomory–Hu min k-cuts (networkx)
    layouts    stage layouts from the domains
    tables     per-stage options: layer count × ZeRO / offload / ministages
    assign     layers → stages, microbatches → lanes (CP-SAT, with a fast exact bottleneck path)
    search     structures × assignments, coarse to fine; `evaluate` scores plans exactly
"""
