"""Mixture of experts: routing, token dispatch, the experts, and the layer that joins them."""
