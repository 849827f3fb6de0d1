//! Message types and helpers shared by the rdmsg examples and their device tests.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

use serde::{Deserialize, Serialize};

/// A sensor reading: telemetry, which does not wake the receiver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Reading {
    /// Sensor number.
    pub sensor: u16,
    /// Sequence number of the reading.
    pub seq: u64,
    /// Measured value.
    pub value: f64,
}
rdmsg::msg::message!(Reading, tag = "rdmsg.example.Reading", solicited = false);

/// An alarm: wakes the receiver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Alarm {
    /// Sensor number.
    pub sensor: u16,
    /// Why.
    pub reason: String,
}
rdmsg::msg::message!(Alarm, tag = "rdmsg.example.Alarm");

/// A request: wakes the server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Request {
    /// Correlates the response.
    pub id: u64,
    /// Operands.
    pub operands: Vec<i64>,
}
rdmsg::msg::message!(Request, tag = "rdmsg.example.Request");

/// A response: wakes the client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Response {
    /// The request's id.
    pub id: u64,
    /// The sum of the operands.
    pub sum: i64,
}
rdmsg::msg::message!(Response, tag = "rdmsg.example.Response");

/// A command for a worker: wakes the receiver.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// Recalibrate a sensor.
    Calibrate {
        /// Sensor number.
        sensor: u16,
        /// New offset.
        offset: f64,
    },
    /// Ship a firmware image (large: fragmented).
    Firmware(Vec<u8>),
}
rdmsg::msg::message!(Command, tag = "rdmsg.example.Command");

pub use rdmsg::transport::loopback_pair;
