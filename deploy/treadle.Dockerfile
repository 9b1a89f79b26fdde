# The treadle image behind compose.yaml's init, worker and sink services: this checkout, installed editable so
# the avro/ schema files stay next to the packages (streams.settings.REPO_ROOT).
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY avro ./avro
COPY kafka ./kafka
COPY streams ./streams
COPY topics ./topics
COPY processors ./processors
COPY sinks ./sinks
RUN pip install --no-cache-dir -e .
ENV TREADLE_HOME=/var/lib/treadle
CMD ["treadle", "worker"]
