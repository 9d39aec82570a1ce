FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md alembic.ini ./
COPY controlplane controlplane
COPY workers workers
COPY loadbench loadbench
COPY migrations migrations
# Pin torch: an unpinned requirement drifts to whatever build the index serves.
RUN pip install --no-cache-dir torch==2.13.0 \
 && pip install --no-cache-dir -e '.[workers]'
EXPOSE 8600
CMD ["controlplane", "serve", "--host", "0.0.0.0"]
