FROM python:3.11-slim
WORKDIR /srv/rackplane
COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY workers ./workers
COPY migrations ./migrations
RUN pip install --no-cache-dir -e .
ENV RACKPLANE_HOST=0.0.0.0
EXPOSE 8000
CMD ["rackplane", "up", "--no-worker"]
