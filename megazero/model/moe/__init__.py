"""Mixture of experts: the routing functions (routing.py) and the Router that owns routing and its
losses (router.py), the token dispatch (dispatch.py), the experts (experts.py, grouped_linear.py), and
the layer that joins them (layer.py)."""
