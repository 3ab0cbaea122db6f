"""Scale-out on Ray, nothing home-made: offline batches over Ray actors and Ray Data
(``ray_batch.py``), and engine replicas on Ray Serve behind prefix-affinity ingresses (``serve_app.py``,
``serve_replica.py``, ``serve_ingress.py``, ``router.py``). Tensor parallelism is not here
(``worker/tp_runner.py``).

Above the entry points: a replica serves the single server's app (``entrypoints/openai/app.py``)
and the batch driver runs the batch runner's rows; the ingress routes with the protocols
(``protocols/``) alone. Only the CLI (``entrypoints/cli.py``) imports this package.
"""
