# The SilentSwarm leader: REST API, Ops UI (/ops/join-v2), Prometheus metrics, job orchestration.
# It finds NATS through Nomad's service discovery; its state lives in JetStream.

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

      # Prometheus's nomad_sd_configs reads these: scrape /api/v1/metrics.
      meta {
        prometheus_scrape = "true"
        prometheus_path   = "/api/v1/metrics"
        ops_ui            = "/ops/join-v2"
      }

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
