"""Standard deviations of the random weights, chosen so that greedy decoding is not degenerate.

With the usual init (std 0.02 everywhere) the logits of a random model are nearly flat: top-1 and
top-2 are within a few hundredths at most steps, so two correct runs part at ties. Every
architecture gives its output projection a larger std (logits with a spread of a few nats) and
its query/key projections a larger std (attention that prefers some positions), so continuations
depend on the whole prompt and ties are rare.
"""

BASE_STD = 0.02
QK_STD = 0.05
EMBED_STD = 0.02
LM_HEAD_STD = 0.15
