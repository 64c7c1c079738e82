"""ARMOR anchors: one verified response per prompt from the frozen reference π_ref.

One vocabulary across the package and the run config's ``anchor`` section:

==================  ==========================================================================
``source``          where π_ref samples: a ``separate`` engine group, or ``swap``-ped into the
                    policy engine around each request (`source`)
``max_tries``       reference samples drawn per prompt before it goes without an anchor
``tries_per_request``  samples asked for at once (the first that passes is the anchor)
``success_reward``  the reward an anchor must reach (1: verified correct; positive anchors only)
``cache``           verified anchors reused per prompt until the next reference reset (`cache`)
``pregenerate``     the next batch's anchors sampled while the trainer updates
==================  ==========================================================================

Modules: `sampler` (rejection sampling, each anchor verified once: its reward travels with it),
`cache` (per-prompt pools keyed by the reference version), `source` (separate / swap, and the
weights each needs), `build` (all of it from a run config). Assembling groups of G around the
anchors is pure math in `armor_megatron.algo.anchors`.
"""
