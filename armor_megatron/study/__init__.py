"""Research studies on the tiny tasks: variants × seeds of ``armor-train``, their curves, table and verdict.

A study drives the trainer from the outside (one ``armor-train`` process per run) and reads what
the runs logged, so it sits above `armor_megatron.trainer`; its tasks and statistics live in
`armor_megatron.tasks`. `runner` runs a study, `plots` draws its figure.
"""
