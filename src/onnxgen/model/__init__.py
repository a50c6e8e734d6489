"""What a model directory holds (:class:`ModelPackage`) and its decoder I/O (:class:`DecoderIO`)."""

from onnxgen.model.derive import derive_io
from onnxgen.model.io import DecoderIO, KVPair, Port, StatePair
from onnxgen.model.package import ModelPackage
from onnxgen.model.settings import ModelSettings

__all__ = ["DecoderIO", "KVPair", "ModelPackage", "ModelSettings", "Port", "StatePair", "derive_io"]
