FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY events ./events
COPY services ./services
COPY warmboot ./warmboot
RUN pip install --no-cache-dir .
ENTRYPOINT []
CMD ["warmboot", "--help"]
