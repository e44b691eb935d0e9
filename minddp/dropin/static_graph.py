"""static_graph=True: stock DDP told that every step runs the same graph, and its numbers.

    pytest tests/test_contract.py          # ManualDDP(static_graph=True) bitwise stock's

With the flag, stock's first backward only learns the graph: its hooks count the gradients,
and every bucket is all-reduced when backward ends. Those are the same sums (an all_reduce
adds each element on its own, whatever else shares its bucket), so the first step's bits
are the default's. But that backward records no arrival order: the buckets are rebuilt from
the second backward's order, before the third forward, one step later than without the
flag. Gloo's ring gives each element of a bucket its summation order by where it sits in
the bucket, so a step reduced in the first layout and one in the rebuilt layout round
differently: from the second step, the flag decides the bits. ManualDDP does the same: the
first synced backward's order is forgotten and the second's rebuilds the buckets.

Stock also uses the learned graph to mark parameters that never get a gradient ready
without searching for them; here such a model needs find_unused_parameters=True.
"""

from ..launch.usage_error import UsageError


class StaticGraphDDP:
    """ManualDDP's static_graph: the buckets rebuilt after the second synced backward."""

    static_graph = False
    _first_order_forgotten = False

    def _set_static_graph(self):
        """Stock's method (the constructor's static_graph=True calls it): before training."""
        if self._backwards:
            raise UsageError("_set_static_graph() after training started",
                             hint="pass static_graph=True to the constructor instead")
        self.static_graph = True

    def _rebuild_buckets(self):
        first_order_complete = len(self._arrival_order) == len(self._params)
        if self.static_graph and not self._rebuilt and first_order_complete \
                and not self._first_order_forgotten:
            # stock's first backward under static_graph records no order: the next one's
            self._arrival_order = []
            self._first_order_forgotten = True
            return
        super()._rebuild_buckets()
