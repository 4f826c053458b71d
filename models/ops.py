"""The ops hx places: the unit of placement everywhere in hx (TwinPilots Table I; FlexGen).

Every family maps its decoder layer onto the seven ``LAYER_OPS`` (``models.family``); ``EMBED``
comes before the layers and ``HEAD`` (final norm and LM head) after them.
"""

SCORE = "SCORE"  # the op that attends over the KV cache (the only op without weights)
LAYER_OPS: tuple[str, ...] = ("Q", "K", "V", SCORE, "OUT", "MLP1", "MLP2")
EMBED, HEAD = "EMBED", "HEAD"
