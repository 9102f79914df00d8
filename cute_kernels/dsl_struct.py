"""Host-side helper objects that live inside kernels.

The DSL carries values through dynamic `while`/`if`/`for` regions only if it
can flatten them to MLIR values and rebuild them. `DslStruct` gives a
dataclass that ability: fields holding Python scalars are compile-time
constants and stay as they are; every other field (Int32, Float32, tensors)
is flattened.
"""

from __future__ import annotations

import dataclasses

import cutlass

_STATIC = (bool, int, float, str, type(None))


class DslStruct:
    def _dynamic_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)
                if not isinstance(getattr(self, f.name), _STATIC)]

    def __extract_mlir_values__(self):
        values, sizes = [], []
        for name in self._dynamic_names():
            field_values = cutlass.extract_mlir_values(getattr(self, name))
            values += field_values
            sizes.append(len(field_values))
        self._field_sizes = sizes
        return values

    def __new_from_mlir_values__(self, values):
        changes, pos = {}, 0
        for name, size in zip(self._dynamic_names(), self._field_sizes):
            changes[name] = cutlass.new_from_mlir_values(getattr(self, name),
                                                         values[pos:pos + size])
            pos += size
        rebuilt = dataclasses.replace(self, **changes)
        rebuilt._field_sizes = self._field_sizes
        return rebuilt
