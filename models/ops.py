"""The ops hx places: the unit of placement everywhere in hx (TwinPilots Table I; FlexGen).

Every family maps its decoder layer onto the seven ``LAYER_OPS`` (``models.family``); ``EMBED``
comes before the layers and ``HEAD`` (final norm and LM head) after them.
"""

SCORE = "SCORE"  # the op that attends over the KV cache (the only op without weights)
LAYER_OPS: tuple[str, ...] = ("Q", "K", "V", SCORE, "OUT", "MLP1", "MLP2")
EMBED, HEAD = "EMBED", "HEAD"
# A Mixture-of-Experts layer whose routed experts are placed one by one (``hx.plan.ExpertHomes``)
# runs them as up to three more ops, each that layer's experts of one home: computed on the
# host, resident on the accelerator, streamed to it. MLP2 keeps the shared expert and the
# residual add (``models.spec.ModelSpec.expert_part``).
EXPERTS_HOST, EXPERTS_RESIDENT, EXPERTS_STREAMED = ("EXPERTS:host", "EXPERTS:resident",
                                                    "EXPERTS:streamed")
EXPERT_OPS: tuple[str, ...] = (EXPERTS_HOST, EXPERTS_RESIDENT, EXPERTS_STREAMED)
