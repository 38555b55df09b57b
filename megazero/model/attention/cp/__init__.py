"""Context parallelism: which tokens each rank holds (``layout``), the context a model carries (``context``),
and the exchanges that compute attention over the whole sequence: the ring (``ring``), all-to-all and
all-gather (``exchanges``), and both levels at once (``hierarchical``)."""
