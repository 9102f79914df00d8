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
    def _dynamic_fields(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, _STATIC):
                yield f.name, value

    def __extract_mlir_values__(self):
        return [v for _, field in self._dynamic_fields()
                for v in cutlass.extract_mlir_values(field)]

    def __new_from_mlir_values__(self, values):
        # Each dynamic field takes as many values as its own template (the
        # field in self) flattens to; the order is that of the extraction.
        rest = list(values)
        rebuilt = {}
        for name, template in self._dynamic_fields():
            count = len(cutlass.extract_mlir_values(template))
            rebuilt[name] = cutlass.new_from_mlir_values(template, rest[:count])
            rest = rest[count:]
        return dataclasses.replace(self, **rebuilt)
