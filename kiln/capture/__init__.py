"""Capture: Dynamo's graph in (``dynamo.py``), AOTAutograd's joint graph out (``aot.py``)."""
