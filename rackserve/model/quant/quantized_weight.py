"""The quantized form of a weight-bearing layer (linears and the lm_head of models/layers.py),
mixed into the layer: the layer's loader slicing (`weight_slice`) is reused to fill int4 groups from
a GGUF checkpoint, and after loading the groups are packed for its kernel and the dense
weight they replace is dropped. This file must never choose which weights stay quantized (the
GGUF loader does, by tensor type) nor compute anything but through its QuantizedLinear kernel.
"""
from __future__ import annotations

from rackserve.model.quant.gguf_blocks import Int4Groups
from rackserve.model.quant.kernel_choice import resolve_quant_kernel
from rackserve.model.quant.quantized_linear import QUANT_KERNELS, QuantizedLinear


class QuantizedWeight:
    """What a layer whose checkpoint weight stays quantized (--quantization gguf) adds to its dense
    form: `load_quantized` fills int4 groups row slice by row slice (`weight_slice` says which,
    as the dense loader slices), and `process_weights_after_loading` packs them for the kernel
    named by `quant_kernel` (the loader sets --quant-kernel's choice; "auto": this machine's best)
    and drops the dense weight it replaces."""

    def __init__(self) -> None:
        super().__init__()
        self.quant: QuantizedLinear | None = None
        self.quant_kernel = "auto"
        self._qweight: Int4Groups | None = None
        self._qrows = 0

    def weight_slice(self, shard_id: object) -> tuple[int, int, int, int, int]:
        """(first row here, first checkpoint row, rows, first checkpoint column, columns) of the
        weight that shard `shard_id` fills."""
        raise NotImplementedError

    def load_quantized(self, loaded: Int4Groups, shard_id: object = None) -> None:
        dst, src, rows, col, cols = self.weight_slice(shard_id)
        if self._qweight is None:
            self._qweight = Int4Groups.empty(loaded.qtype, *self.weight.shape)
            # Rows no shard fills (vocab padding) compute 0.
            self._qweight.codes.fill_(8)
            self._qweight.scales.zero_()
            self._qweight.zeros.zero_()
        self._qweight.narrow(0, dst, rows).copy_(loaded.narrow(0, src, rows).narrow(1, col, cols))
        self._qrows += rows

    def process_weights_after_loading(self) -> None:
        if self._qweight is None:
            return
        if self._qrows < self._dense_rows():
            raise ValueError(f"{type(self).__name__}: some of its checkpoint tensors are quantized and some are "
                             "not; load it with --quantization none")
        kernel = resolve_quant_kernel(self.quant_kernel, "gguf", self._qweight.codes.device.type).name
        self.quant, self._qweight = QUANT_KERNELS.get(kernel)(self._qweight), None
        if self.weight is not getattr(self, "tied_weight", None):
            self.weight = None

    def _dense_rows(self) -> int:
        return self.weight.shape[0]
