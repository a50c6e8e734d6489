"""Serving onnxgen beyond one process: engine replicas behind one OpenAI-compatible ingress (Ray Serve).

:mod:`onnxgen.serving.engine` loads one replica's app (the same app ``onnxgen serve`` runs),
:mod:`onnxgen.serving.asgi` runs that app in process for forwarded requests, :mod:`onnxgen.serving.affinity`
keys requests by their prompt's leading parts for prefix-aware routing, and :mod:`onnxgen.serving.ray`
deploys it all on Ray Serve (optional dependency: ``pip install 'onnxgen[ray]'``).
"""
