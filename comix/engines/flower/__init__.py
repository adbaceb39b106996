"""Flower engine (``pip install comix[flower]``, flwr 1.41): the same server loop and client
steps as the in-process engine, carried by Flower messages between a SuperLink and SuperNodes.

  client_app.py  the device: answers init / train / finish / evaluate messages with a ``Device``
  server_app.py  the server: ``engines.server.serve`` over a Flower ``Grid``
  wire.py        tensors and metrics <-> Flower records
  deploy.py      certificates, SuperNode keys, starting and stopping SuperLink / SuperNodes
"""
