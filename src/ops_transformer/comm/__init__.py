"""Communication: recorded collectives, autograd-aware primitives and the ledger."""

from .ledger import CommLedger, CommRecord, CommStep, wire_elements
from .primitives import (all_gather_along, all_to_all, copy_to_tp_region, gather_from_tp_region,
                         reduce_from_tp_region, reduce_scatter_along, scatter_to_tp_region)

__all__ = ["CommLedger", "CommRecord", "CommStep", "wire_elements", "all_gather_along",
           "all_to_all", "copy_to_tp_region", "gather_from_tp_region", "reduce_from_tp_region",
           "reduce_scatter_along", "scatter_to_tp_region"]
