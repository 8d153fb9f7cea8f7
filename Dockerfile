FROM python:3.11-slim
WORKDIR /srv/rackplane
COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY workers ./workers
COPY migrations ./migrations
# The wire schemas the API shares with node agents; the agent and the tools beside the product.
COPY rackplane_wire ./rackplane_wire
COPY rackplane_agent ./rackplane_agent
COPY rackplane_bench ./rackplane_bench
RUN pip install --no-cache-dir -e .
ENV RACKPLANE_HOST=0.0.0.0
EXPOSE 8000
CMD ["rackplane", "up", "--no-worker"]
