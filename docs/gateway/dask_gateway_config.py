# dask-gateway-server config for dask_dl: the cluster options dask_dl.cluster.make("gateway") sets, and worker
# commands that exist in today's distributed.
#
#   DASK_GATEWAY_PASSWORD=... dask-gateway-server -f dask_gateway_config.py
#
# Addresses and the password come from environment variables so that one file serves a laptop, CI and a site.
# This example runs clusters as local processes of the server's own user (UnsafeLocalBackend, simple password
# auth): right for one person, CI and tests. A shared site keeps the options handler and the commands below and
# swaps the backend (Kubernetes, Hadoop/YARN, a job queue) and the authenticator (JupyterHub, Kerberos).
import os
import sys

from dask_gateway_server.options import Float, Integer, Mapping, Options

c = get_config()  # noqa: F821  (provided by dask-gateway-server when it reads this file)

# Nothing listens on all interfaces unless asked.
c.DaskGateway.address = os.environ.get("DASK_GATEWAY_ADDRESS", "127.0.0.1:8000")
c.Proxy.address = os.environ.get("DASK_GATEWAY_PROXY_ADDRESS", "127.0.0.1:8001")

# LocalBackend (one system user per gateway user) is broken in dask-gateway-server 2026.3; the unsafe variant runs
# every cluster as the server's user.
c.DaskGateway.backend_class = "dask_gateway_server.backends.local.UnsafeLocalBackend"
c.DaskGateway.authenticator_class = "dask_gateway_server.auth.SimpleAuthenticator"
c.SimpleAuthenticator.password = os.environ["DASK_GATEWAY_PASSWORD"]
if "DASK_GATEWAY_CLUSTERS_DIRECTORY" in os.environ:  # the clusters' working folders (logs); default ~/.dask-gateway
    c.LocalBackend.clusters_directory = os.environ["DASK_GATEWAY_CLUSTERS_DIRECTORY"]

# The server's defaults name the dask-scheduler / dask-worker scripts, which distributed no longer ships.
c.ClusterConfig.scheduler_cmd = [sys.executable, "-m", "distributed.cli.dask_scheduler"]
c.ClusterConfig.worker_cmd = [sys.executable, "-m", "distributed.cli.dask_worker"]
c.ClusterConfig.idle_timeout = 3600  # seconds; a cluster nobody uses goes away


def options_handler(options, user):
    """Turn the options a user chose into cluster settings: cores, memory, GPU resource, environment."""
    environment = dict(options.environment)
    if options.gpus:
        # Trainers go to workers with a GPU resource. The value is a Python literal so that the key keeps its case
        # (dask lower-cases the names in DASK_..._RESOURCES__GPU style variables).
        environment["DASK_DISTRIBUTED__WORKER__RESOURCES"] = repr({"GPU": options.gpus})
    return {
        "worker_cores": options.worker_cores,
        "worker_memory": int(options.worker_memory * 2**30),
        "environment": environment,
    }


c.Backend.cluster_options = Options(
    Integer("worker_cores", default=1, min=1, max=8, label="Cores per worker"),
    Float("worker_memory", default=1.0, min=0.25, max=64.0, label="Memory per worker (GiB)"),
    Integer("gpus", default=0, min=0, max=8, label="GPUs per worker (a GPU worker resource)"),
    Mapping("environment", default={}, label="Environment variables of the workers"),
    handler=options_handler,
)
