#include "tests/integration/server_process.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

namespace attnserve::testing {
namespace {

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// This process's environment with `extra` ("NAME=value") added, replacing variables of the
// same name: the child's alone, so the parent never calls setenv while gRPC threads may read it.
std::vector<std::string> ChildEnvironment(const std::vector<std::string>& extra) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('=') + 1);
    const bool replaced =
        std::any_of(extra.begin(), extra.end(), [&](const std::string& x) { return x.rfind(name, 0) == 0; });
    if (!replaced) env.push_back(entry);
  }
  env.insert(env.end(), extra.begin(), extra.end());
  return env;
}

// fork + exec with stdout and stderr into `log_path`; the child gets SIGKILL when this thread
// dies. Only async-signal-safe calls between fork and exec (gRPC threads exist in the parent).
pid_t Spawn(const std::string& binary, const std::vector<std::string>& args, const std::vector<std::string>& extra_env,
            const std::string& log_path) {
  std::vector<std::string> all = {binary};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env = ChildEnvironment(extra_env);
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return -1;
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died before prctl
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  close(log_fd);
  return pid;
}

// Waits for `pid` up to `timeout`; the exit status, 128 + signal, or -1 (still running).
int WaitFor(pid_t pid, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (r < 0 && errno != EINTR) return -2;  // not our child any more
    if (std::chrono::steady_clock::now() >= until) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int KillAndReap(pid_t pid, int signal, std::chrono::seconds timeout) {
  kill(pid, signal);
  int status = WaitFor(pid, timeout);
  if (status == -1) {
    kill(pid, SIGKILL);
    WaitFor(pid, std::chrono::seconds(10));
  }
  return status;
}

}  // namespace


std::unique_ptr<ServerProcess> ServerProcess::Start(const std::string& binary, const std::vector<std::string>& args,
                                                    std::string* error, std::chrono::seconds timeout,
                                                    const std::vector<std::string>& env,
                                                    const ClientOptions& client) {
  std::unique_ptr<ServerProcess> server(new ServerProcess());
  std::string tmpl = (std::filesystem::temp_directory_path() / "attnserve_srv_XXXXXX").string();
  if (mkdtemp(tmpl.data()) == nullptr) {
    *error = "cannot create a temporary folder";
    return nullptr;
  }
  server->dir_ = tmpl;
  const std::string port_file = server->dir_ + "/port";
  // Metrics on an ephemeral port too, so that servers side by side never collide on 9464.
  std::vector<std::string> all = {"--listen", "127.0.0.1:0", "--port-file", port_file, "--metrics-listen",
                                  "127.0.0.1:0"};
  all.insert(all.end(), args.begin(), args.end());
  server->pid_ = Spawn(binary, all, env, server->dir_ + "/log");
  if (server->pid_ < 0) {
    *error = "cannot start " + binary;
    return nullptr;
  }
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (server->port_ == 0) {
    const int exited = WaitFor(server->pid_, std::chrono::milliseconds(0));
    if (exited >= 0) {
      server->pid_ = -1;
      *error = "the server exited with status " + std::to_string(exited) + " before listening:\n" + server->Log();
      return nullptr;
    }
    if (std::chrono::steady_clock::now() >= until) {
      *error = "the server did not write its port file in time:\n" + server->Log();
      return nullptr;  // the destructor kills it
    }
    const std::string text = ReadFile(port_file);
    if (!text.empty()) server->port_ = std::atoi(text.c_str());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ClientOptions options = client;
  options.target = server->target();
  options.timeout = std::chrono::milliseconds(60000);
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--admin-token") options.admin_token = args[i + 1];
  }
  server->client_ = std::make_unique<Client>(options);
  for (;;) {
    bool serving = false;
    if (server->client_->Health("", &serving).ok() && serving) return server;
    if (std::chrono::steady_clock::now() >= until) {
      *error = "the server is not SERVING in time:\n" + server->Log();
      return nullptr;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

ServerProcess::~ServerProcess() {
  client_.reset();
  if (pid_ > 0) KillAndReap(pid_, SIGTERM, std::chrono::seconds(15));
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

std::string ServerProcess::Log() const { return ReadFile(dir_ + "/log"); }

bool ServerProcess::WaitForLog(const std::string& needle, std::chrono::milliseconds timeout) const {
  const auto give_up = std::chrono::steady_clock::now() + timeout;
  while (Log().find(needle) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= give_up) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

int ServerProcess::Stop(int signal, std::chrono::seconds timeout) {
  if (pid_ <= 0) return -2;
  const int status = KillAndReap(pid_, signal, timeout);
  pid_ = -1;
  return status;
}

int RunToExit(const std::string& binary, const std::vector<std::string>& args, std::string* output,
              std::chrono::seconds timeout) {
  TempDir dir;
  const std::string log = dir.File("log");
  const pid_t pid = Spawn(binary, args, {}, log);
  if (pid < 0) return -3;
  int status = WaitFor(pid, timeout);
  if (status == -1) {
    kill(pid, SIGKILL);
    WaitFor(pid, std::chrono::seconds(10));
  }
  *output = ReadFile(log);
  return status;
}

std::string ScrapeMetrics(int metrics_port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(metrics_port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
    const std::string request = "GET /metrics HTTP/1.0\r\n\r\n";
    (void)!write(fd, request.data(), request.size());
    char buf[8192];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) response.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

double MetricSample(const std::string& scrape, const std::string& series) {
  std::istringstream in(scrape);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series + " ", 0) == 0) return std::strtod(line.c_str() + series.size() + 1, nullptr);
  }
  return -1;
}

MetricsServer::MetricsServer(const std::string& binary, std::vector<std::string> args) {
  const std::string port_file = dir.File("metrics_port");
  args.insert(args.end(), {"--metrics-port-file", port_file});
  std::string error;
  process = ServerProcess::Start(binary, args, &error);
  EXPECT_NE(process, nullptr) << error;
  std::ifstream in(port_file);
  in >> metrics_port;  // written before the gRPC port file that Start waited for
}

double MetricsServer::WaitForSample(const std::string& series, double value, std::chrono::seconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  double got = Sample(series);
  while (got != value && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    got = Sample(series);
  }
  return got;
}

}  // namespace attnserve::testing
