"""The series a generation model publishes on Triton's metrics port for the door to read.

Triton keeps only the inputs, outputs and batching of an auto-completed config, so a model's
facts travel as gauges: its capabilities as one JSON label that never changes, and each adapter
it offers as a line of its own (1 on offer, 0 withdrawn) beside their count.
"""

CAPABILITIES_METRIC = "neopp_model_capabilities"  # {model, capabilities="<JSON>"} 1
ADAPTER_METRIC = "neopp_model_adapter"  # {model, adapter} 1 on offer, 0 withdrawn
ADAPTERS_METRIC = "neopp_model_adapters"  # {model}: how many it offers (past the listed names too)
