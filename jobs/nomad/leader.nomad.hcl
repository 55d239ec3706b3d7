# The SilentSwarm leader: REST API, Ops UI (/ops/join-v2), Prometheus metrics, job orchestration.
# It finds NATS through Nomad's service discovery; its state lives in JetStream. Until the
# swarm-nats service is registered it gets an address that cannot resolve (and waits), never
# none (without one it would start a private nats-server of its own).

variable "datacenters" {
  type    = list(string)
  default = ["dc1"]
}

variable "leader_port" {
  type    = number
  default = 8080
}

job "swarm-leader" {
  datacenters = var.datacenters
  type        = "service"

  group "leader" {
    count = 1

    network {
      port "http" {
        static = var.leader_port
      }
    }

    service {
      name     = "swarm-leader"
      port     = "http"
      provider = "nomad"
      tags     = ["ops-ui", "prometheus"]

      # Nomad's native services carry no meta to Prometheus: find the leader by the
      # "prometheus" tag (nomad_sd_configs) and scrape metrics_path /api/v1/metrics.

      check {
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "2s"
      }
    }

    restart {
      attempts = 10
      interval = "30m"
      delay    = "5s"
      mode     = "delay"
    }

    task "leader" {
      driver = "raw_exec"

      config {
        command = "/opt/silentswarm/bin/swarm-leader"
      }

      env {
        SWARM_LEADER_HOST = "0.0.0.0"
        SWARM_LEADER_PORT = "${NOMAD_PORT_http}"
        SWARM_STATE_DIR   = "${NOMAD_ALLOC_DIR}/data"
        SWARM_LOG_LEVEL   = "INFO"
      }

      template {
        destination = "local/nats.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{- range nomadService "swarm-nats" }}
        SWARM_NATS_URL=nats://{{ .Address }}:{{ .Port }}
        {{- else }}
        SWARM_NATS_URL=nats://swarm-nats-not-registered.invalid:4222
        {{- end }}
        EOT
      }

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }
}
