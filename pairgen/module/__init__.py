"""What the drop-in modules (pairgen/ops/<op>/module.py) are built from, one file per concern:

- kernel_module: `KernelModule`, the mixin every drop-in module is built on (the variant per
  length, fast calls, held state, running a call), and `TensorCorePrecisions` (`precision=`);
- dispatch: `route`, the one function that decides which path a call runs (`Route`, `Routing`);
- autograd: the training paths' autograd Functions (`ReferenceBackward`, `SavedClosedForm`);
- parameters: `ParameterSlots` (the parameters as each call finds them), `CallWeights` (the
  weights one call runs on);
- buffers: `HeldBuffer`, `grow_held` (scratch kept between calls);
- validation: `check_float_tensor`, `check_mask`, `as_mask`, `contiguous_aligned`;
- modes: `current_autocast`, `autocast_off`, `as_dtype`, `cublas_fp32_mode`, `fp32_matmul`.

The precisions themselves are pairgen/precision.py. Nothing is imported here: import the file
that holds a name."""
