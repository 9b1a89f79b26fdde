# The treadle image behind compose.yaml's init, worker and sink services: this checkout built into a wheel and
# installed with the worker, sink and cli extras (schemas, migrations and the Kafka pom travel as package data).

# treadle_native (native/: the Avro record codec) is built into a wheel in a Rust image; the runtime image only
# installs that wheel. Without it treadle would run on its generated Python codec (see README "Native codec").
FROM rust:1-slim-bookworm AS native
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/maturin && /opt/maturin/bin/pip install --no-cache-dir "maturin>=1.5,<2"
COPY native /native
RUN /opt/maturin/bin/maturin build --release --manifest-path /native/Cargo.toml --interpreter python3 --out /wheels

FROM python:3.11-slim-bookworm
WORKDIR /src
COPY pyproject.toml README.md ./
COPY avro ./avro
COPY treadle ./treadle
COPY streams ./streams
COPY topics ./topics
COPY processors ./processors
COPY sinks ./sinks
COPY --from=native /wheels /wheels
RUN pip install --no-cache-dir ".[worker,sink,cli]" /wheels/*.whl
ENV TREADLE_HOME=/var/lib/treadle
CMD ["treadle", "worker"]
