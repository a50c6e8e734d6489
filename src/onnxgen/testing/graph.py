"""A small ONNX graph builder for the tiny test decoders (onnx.helper underneath).

Each ``op`` call appends one node and returns its output name(s); names are made unique from a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

Dim = int | str | None

_DTYPES = {
    "float32": TensorProto.FLOAT,
    "float16": TensorProto.FLOAT16,
    "int64": TensorProto.INT64,
    "int32": TensorProto.INT32,
    "uint8": TensorProto.UINT8,
    "bool": TensorProto.BOOL,
}


def onnx_dtype(dtype: str) -> int:
    return _DTYPES[dtype]


class GraphBuilder:
    """Accumulates inputs, outputs, initializers and nodes of one graph."""

    def __init__(self, name: str = "graph") -> None:
        self.name = name
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self._names: set[str] = set()
        self._counter = 0

    # -- names ---------------------------------------------------------------------------------
    def fresh(self, prefix: str) -> str:
        while True:
            self._counter += 1
            name = f"{prefix}_{self._counter}"
            if name not in self._names:
                self._names.add(name)
                return name

    # -- ports ---------------------------------------------------------------------------------
    def input(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, onnx_dtype(dtype), list(shape)))
        self._names.add(name)
        return name

    def output(self, name: str, dtype: str, shape: Sequence[Dim] | None) -> str:
        shp = None if shape is None else list(shape)
        self.outputs.append(helper.make_tensor_value_info(name, onnx_dtype(dtype), shp))
        return name

    def const(self, value: np.ndarray | float | int | Sequence[int], name: str | None = None) -> str:
        """An initializer; python ints/lists become int64, floats float32."""
        if not isinstance(value, np.ndarray):
            arr = np.asarray(value)
            arr = arr.astype(np.int64) if arr.dtype.kind in "iu" else arr.astype(np.float32)
        else:
            arr = value
        name = name or self.fresh("const")
        self._names.add(name)
        self.initializers.append(numpy_helper.from_array(arr, name))
        return name

    # -- nodes ---------------------------------------------------------------------------------
    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        n_out: int = 1,
        *,
        domain: str = "",
        outputs: Sequence[str] | None = None,
        **attrs: Any,
    ) -> str | list[str]:
        """Append a node; returns its single output name, or a list when ``n_out`` > 1."""
        outs = list(outputs) if outputs is not None else [self.fresh(op_type.lower()) for _ in range(n_out)]
        self._names.update(outs)
        self.nodes.append(
            helper.make_node(
                op_type, list(inputs), outs, name=self.fresh(op_type), domain=domain or None, **attrs
            )
        )
        return outs[0] if len(outs) == 1 else outs

    def op1(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        domain: str = "",
        out: str | None = None,
        **attrs: Any,
    ) -> str:
        """Append a single-output node; returns its output name (``out`` when given)."""
        outs = [out] if out is not None else [self.fresh(op_type.lower())]
        self.op(op_type, inputs, domain=domain, outputs=outs, **attrs)
        return outs[0]

    def opn(
        self,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str | None],
        *,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        """Append a node with several outputs; ``None`` entries get fresh names. Returns all output names."""
        outs = [o if o is not None else self.fresh(op_type.lower()) for o in outputs]
        self.op(op_type, inputs, domain=domain, outputs=outs, **attrs)
        return outs

    def graph(self) -> onnx.GraphProto:
        return helper.make_graph(
            self.nodes, self.name, self.inputs, self.outputs, initializer=self.initializers
        )

    def model(self, opset: int = 21, ms_opset: int | None = 1) -> onnx.ModelProto:
        imports = [helper.make_opsetid("", opset)]
        if ms_opset is not None:
            imports.append(helper.make_opsetid("com.microsoft", ms_opset))
        m = helper.make_model(self.graph(), opset_imports=imports, producer_name="onnxgen.testing")
        m.ir_version = 10 if opset <= 22 else 11
        return m


def save_model(model: onnx.ModelProto, directory: str | Path, external_data: bool = True) -> Path:
    """Write ``model.onnx`` (weights in ``model.onnx.data`` when ``external_data``) into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "model.onnx"
    if external_data:
        onnx.save_model(
            model,
            str(path),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="model.onnx.data",
            size_threshold=1024,
        )
    else:
        onnx.save_model(model, str(path))
    return path
