# syntax=docker/dockerfile:1
# vLLM's image with kvhost's Python client installed, for pods whose vLLM
# keeps KV blocks in kvhost (docs/vllm.md, "Kubernetes"). From the
# repository root:
#
#   docker build -f deploy/docker/vllm.Dockerfile -t vllm-kvhost:dev .
#
# (make image-vllm.) VLLM_IMAGE picks the vLLM image to extend (its Python
# runs vLLM and the client): by default v0.28.0, the first release with
# the secondary-tier interface the client needs (vLLM main a123159f, between
# v0.27 and v0.28: docs/vllm.md); an older one is refused when vLLM loads
# the tier. KVHOST_SOCKET is the socket of the daemon's images and units
# (/run/kvhost/kvhost.sock, a hostPath both pods mount); override it with
# the pod's env where the daemon listens elsewhere. The client's one C module, the shared lookup table's probe, is
# built where the image has a C compiler and Python's headers; without
# them the client uses its Python reader of the table, and the build says
# so in a warning. pip fetches setuptools to build the client; where the
# build has no network, add --no-index --no-build-isolation (the image's
# own setuptools then builds it: 70.1 or later, or with wheel installed).

ARG VLLM_IMAGE=vllm/vllm-openai:v0.28.0

FROM ${VLLM_IMAGE}
COPY client/python /tmp/kvhost-client
RUN python3 -m pip install --no-cache-dir /tmp/kvhost-client \
 && rm -rf /tmp/kvhost-client \
 && python3 -c "import kvhost.vllm"
ENV KVHOST_SOCKET=/run/kvhost/kvhost.sock
